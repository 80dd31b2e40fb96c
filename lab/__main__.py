"""`python -m lab compare|bench|pretrain|doctor-eval|doctor-sample --help` (lab/__init__.py set
OpenMP's wait policy before torch loads)."""

from lab.experiments import main

main()
