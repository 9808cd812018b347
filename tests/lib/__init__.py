"""The test library: rigs, harnesses and servers the stages and bench/ share (never
shipped: the wheel holds the product and the demo only)."""
