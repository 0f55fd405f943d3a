"""What a model is built from, below both the models and the engine that runs them: the attention seam
(autoprofile.layers.attention: the backend interface, its metadata, a layer's KV view) and the
tensor-parallel layers (autoprofile.layers.parallel). Imports run one way: engine -> models -> layers."""
