"""Mixture of experts: router (router.py), token dispatchers (dispatcher.py), the experts
(experts.py) and the layer that fills the transformer layer's MLP slot (layer.py)."""
