"""Helpers shared by the models' load_weights: copy into (fused) parameters and check nothing is missing."""

from __future__ import annotations

import torch
from torch import nn


class WeightLoader:
    """Copies Hugging Face tensors into a module's parameters, counting elements so gaps are caught."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        # param name -> elements it holds: the parameters are looked up at each copy, since a module may be given
        # storage (a parameter built on the meta device) or quantized (its weight replaced) while loading.
        self.numels: dict[str, int] = {name: p.numel() for name, p in module.named_parameters()}
        self.loaded: dict[str, int] = {}  # param name -> elements copied so far

    def _param(self, param_name: str, source: str) -> nn.Parameter:
        if param_name not in self.numels:
            raise ValueError(f"unexpected weight {source!r} (no parameter {param_name!r})")
        return self.module.get_parameter(param_name)

    def copy(self, param_name: str, tensor: torch.Tensor, offset: int = 0, source: str | None = None) -> None:
        """Copies tensor into rows [offset, offset + len) of the parameter (the whole of it when offset is 0)."""
        source = source or param_name
        param = self._param(param_name, source)
        whole = offset == 0 and tensor.shape == param.shape
        target = param.data if whole else param.data.narrow(0, offset, min(tensor.shape[0], param.shape[0] - offset))
        if target.shape != tensor.shape:
            raise ValueError(
                f"weight {source!r}: shape {tuple(tensor.shape)} does not fit {param_name} {tuple(target.shape)}"
            )
        target.copy_(tensor)
        self.loaded[param_name] = self.loaded.get(param_name, 0) + tensor.numel()

    def copy_shared(self, param_name: str, tensor: torch.Tensor, source: str | None = None) -> None:
        """A parameter every part of a fused projection provides whole (an act-order input permutation): the
        first copy fills it, later ones must equal it (one input order serves the fused weight)."""
        source = source or param_name
        param = self._param(param_name, source)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"weight {source!r}: shape {tuple(tensor.shape)} does not fit {param_name} "
                             f"{tuple(param.shape)}")
        if param_name not in self.loaded:
            param.data.copy_(tensor)
            self.loaded[param_name] = tensor.numel()
        elif not torch.equal(param.data.cpu(), tensor.to(param.dtype).cpu()):
            raise ValueError(f"weight {source!r}: its input-column order differs from that of the other parts of "
                             f"{param_name.rsplit('.', 1)[0]}, which share one input (act-order g_idx must agree)")

    def count(self, param_name: str, num_elements: int) -> None:
        """Records elements a module copied itself (a MoE expert's slice of a stacked parameter)."""
        if param_name not in self.numels:
            raise ValueError(f"unexpected weight for {param_name!r}")
        self.loaded[param_name] = self.loaded.get(param_name, 0) + num_elements

    def finish(self) -> None:
        """Raises ValueError naming the parameters the checkpoint did not (fully) provide."""
        missing = [name for name, numel in self.numels.items() if self.loaded.get(name, 0) != numel]
        if missing:
            more = " ..." if len(missing) > 8 else ""
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}{more}")
