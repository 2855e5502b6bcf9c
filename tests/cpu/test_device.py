"""``vime.device.HostStash``: what ``sleep`` does to a rank's tensors, on any device.

Proves: parked storages are freed in place (every view and reference stays the same
object) and come back bit for bit; a storage shared by several tensors is parked once;
scratch storages are freed without a host copy (``nbytes`` counts only copies) and come
back zero-filled, even where their bytes were not zero; a storage named both ways is
copied, not zeroed; ``restore`` is idempotent.
"""

from __future__ import annotations

import torch

from vime.device import HostStash


def test_parked_come_back_bitwise_and_scratch_zeroed() -> None:
    torch.manual_seed(0)
    weight = torch.randn(4, 8)
    view = weight[1:3]  # shares weight's storage
    grads = torch.randn(32)  # a scratch buffer that, unusually, holds non-zeros
    both = torch.randn(6)
    before_weight, before_both = weight.clone(), both.clone()
    stash = HostStash([weight, view, both], scratch=[grads, both])
    assert stash.nbytes == weight.nbytes + both.nbytes  # the view's storage once, no scratch
    for t in (weight, view, grads, both):
        assert t.untyped_storage().nbytes() == 0
    stash.restore()
    assert torch.equal(weight, before_weight) and torch.equal(view, before_weight[1:3])
    assert torch.equal(both, before_both)  # named as kept first: copied, not zeroed
    assert torch.equal(grads, torch.zeros(32))
    stash.restore()  # idempotent
    assert torch.equal(weight, before_weight)
