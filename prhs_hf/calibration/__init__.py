"""Offline calibration: PSAW and ETF schedules from measured attention mass (``prhs-hf calibrate``),
Double Sparsity's label channels (``prhs-hf calibrate-ds``), and the dense pass both read.

- :mod:`.options`: the commands' defaults, allowed values and checks (:class:`~.options.CalibrationError`);
- :mod:`.texts`: the calibration text (``--text``, ``--dataset``) packed into token prompts;
- :mod:`.dense_pass`: dense forwards of the unpatched model that hand each layer's query and key to a hook;
- :mod:`.measurement`: the attention mass every candidate PSAW/ETF schedule would drop, per layer;
- :mod:`.flops`: the prefill FLOP model the schedules are ranked by;
- :mod:`.search`: the choice of the schedule pair, the nearest miss, ``β_emp``;
- :mod:`.report`: the chosen pair as a terminal summary, a YAML config and a plot;
- :mod:`.command`: :func:`~.command.calibrate` and ``prhs-hf calibrate`` (:func:`~.command.run`);
- :mod:`.ds_channels`: Double Sparsity's label channels, their file and ``prhs-hf calibrate-ds``.

Nothing in the runtime imports this package; its results reach the runtime as config values and
files. Importing :mod:`.options`, :mod:`.command` or :mod:`.ds_channels` imports neither torch
nor transformers (the command line builds its parser from them).
"""
