"""Graph work: find attention in a Dynamo graph and rewrite it to `torch.ops.fa3.attention`
(installed as `fa_compile.patterns`). Pure torch.fx; imports neither kernels nor the front door."""
