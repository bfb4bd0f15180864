"""Number formats and their casts: the FP8 recipes (recipe), current and delayed scaling (scaling), the
microscaled formats (microscaling) and their recipe and cast operators (mx), the block-wise casts
(blockwise_cast), and the type of a weight all-gathered in its narrow format (gathered)."""
