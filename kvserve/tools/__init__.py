"""Tools beside serving: the roofline measurements and cost model (roofline) and the MTP
drafter's training (train_mtp)."""
