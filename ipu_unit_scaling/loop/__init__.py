"""The one training loop, and the tasks it trains (causal LM, masked LM). It sits above the
backends, which it selects and drives."""
