"""`python -m hpctrain.status RUN`: where a run stands and where its allocated time went."""
