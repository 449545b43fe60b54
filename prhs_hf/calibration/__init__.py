"""Offline calibration: PSAW and ETF schedules from measured attention mass (``prhs-hf calibrate``),
Double Sparsity's label channels (``prhs-hf calibrate-ds``), and the dense pass both read.

Nothing in the runtime imports this package; its results reach the runtime as config values and files.
"""
