"""Hidden states a forward keeps beside its logits, for a draft model that reads the target's features (EAGLE).

EAGLE heads read the final hidden states (after the final norm); EAGLE-3 heads read the inputs of three layers,
concatenated. The layers' inputs are taken by forward hooks on the layer before each (its output is the pair (MLP
output, residual), whose sum is the next layer's input; layer 0's input is the embedding), so no model class changes.
Inside a CUDA graph the hooks run at capture, so the graph itself copies the states to the runner's static buffer.
"""

from __future__ import annotations

import torch
from torch import nn


class HiddenCapture:
    """`layers`: the decoder layers whose inputs to keep, in order (empty: the final hidden states)."""

    def __init__(self, model: nn.Module, layers: tuple[int, ...] = ()):
        self.layers = tuple(layers)
        self._parts: dict[int, torch.Tensor] = {}
        count = len(model.model.layers)
        bad = [i for i in self.layers if not 0 <= i < count]
        if bad:
            raise ValueError(f"hidden states of layers {bad} asked for, but the model has {count} layers")
        for j, layer in enumerate(self.layers):
            source = model.model.embed_tokens if layer == 0 else model.model.layers[layer - 1]
            source.register_forward_hook(self._keeper(j))

    def width(self, hidden_size: int) -> int:
        """Columns of what `take` returns."""
        return hidden_size * max(1, len(self.layers))

    def _keeper(self, j: int):
        def keep(_module, _inputs, output):
            self._parts[j] = output if isinstance(output, torch.Tensor) else output[0] + output[1]
        return keep

    def take(self, final: torch.Tensor) -> torch.Tensor:
        """This forward's kept states, [num_tokens, width]; `final`: the forward's final hidden states."""
        if not self.layers:
            return final
        parts, self._parts = self._parts, {}
        return torch.cat([parts[j] for j in range(len(self.layers))], dim=-1)
