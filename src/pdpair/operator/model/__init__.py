"""The shapes every layer reads: the operator's settings, the spec fields, what a pass observed, conditions."""
