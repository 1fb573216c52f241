"""AdaQP (arXiv 2306.01381): ``policy`` (its decisions), ``milp`` (the bit assignment, pure),
``distributed`` (the assignment across ranks)."""
