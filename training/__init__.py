"""Training: the DP core (``dp``), the recipes (``recipes``), their data (``data``) and the run
skeleton (``skeleton``); the ``vip-hub`` training commands and the main job."""
