"""The Fashion-MNIST study: DP encoders against handcrafted features at one budget, one protocol.

``vip-hub run`` (``training/main_job.py``) and ``benchmarks/utility.py`` both run it; what may
differ between the two is a field of ``config.StudyConfig``, whose presets ``JOB`` and
``BENCHMARK`` stand side by side there. The modules, one rule each:

- ``config``: the settings, their presets, and the DP encoders' recipe settings;
- ``splits``: which records are private, which choose feature modes, centre the heads and score;
- ``features``: raw pixels and encoder features of the records;
- ``budget``: the split rule (an encoder's epsilon, its head the rest) and the composition;
- ``heads``: the DP linear head of a row, its settings, centring and ledger stage;
- ``selection``: each (Syn) encoder's feature mode, chosen on the public selection records;
- ``table``: a row of the comparison, and zero-shot's test against chance.
"""
