"""Tools beside serving: this machine's ceilings (ceilings), where a model's steps sit
against them (roofline), and the MTP drafter's training (train_mtp)."""
