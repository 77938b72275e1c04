"""u-μP: the rules that set each weight's initial scale, multiplier and learning rate, and the
optimizers that read them."""
