"""The steps of the training recipe that both scripts share, and the base modules under them."""
