"""Distilling drafters from the user's own target (depends only on models/ and drafters/).

data.py: self-distilled shards (the target's answers and final hidden states);
fit.py: the hidden-state head's unrolled training and validation acceptance.
"""
