"""AdaQP (arXiv 2306.01381): its policy, bit-assignment MILP and distributed assignment.

``policy`` (its decisions), ``milp`` (the bit assignment, pure), ``distributed`` (the
assignment across ranks).
"""
