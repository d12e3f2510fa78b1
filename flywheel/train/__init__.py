"""Policy training: the GRPO loss family, SFT warm start, trainer and stages.

Modules (imported explicitly; this package imports nothing, so importing one torch-free module such
as ``demos`` loads no trainer): ``losses``, ``data``, ``trainer``, ``demos`` (SFT demonstrations and
the held-out rule, torch-free), ``sft`` (rendering and samples), ``stage`` (``train_grpo`` /
``train_sft``, what the CLI and flows call). The objective's knobs are ``[train.objective]`` in
:mod:`flywheel.config`; advantages are :mod:`flywheel.advantages` (shared with rollouts).
"""
