"""The DP core: Poisson sampling, the clippers, the canaries, the DP engine and the DP run;
what a run's privacy guarantee rests on (it imports no recipe and no data code)."""
