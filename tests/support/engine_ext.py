"""A worker extension for tests: xcluster's, plus a way to damage one loaded weight in the engine."""

from __future__ import annotations

import torch

from xcluster.follow.vllm_worker import XclusterWorkerExtension


class DamagingExtension(XclusterWorkerExtension):
    """``collective_rpc xcluster_test_flip``: flip the lowest bit of one element of a parameter, as
    a bad host-to-device copy or a stray write would."""

    def xcluster_test_flip(self, param: str, index: int) -> str:
        p = dict(self._xc_model().named_parameters())[param]
        bits = p.data.view(-1).view(torch.int16 if p.element_size() == 2 else torch.int32)
        bits[index:index + 1].bitwise_xor_(1)
        return f"flipped bit 0 of {param}[{index}]"
