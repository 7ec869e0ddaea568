"""``lightprune.prune``: the API of ``torch.nn.utils.prune``, exact, fast at any size and lean in memory.

Swap ``from torch.nn.utils import prune`` for ``from lightprune import prune`` and keep your code: the names,
signatures, reparametrization (``name_orig``, ``name_mask``, forward pre-hook) and state_dict keys are torch's.

Beyond torch's API: :func:`mask_dtype` (boolean masks), :func:`prepare_for_state_dict` (load checkpoints across the
reparametrization), :func:`pruned_names` and :func:`original` (which tensors are pruned, and the Parameter behind
one), :func:`refresh_pruned`, :func:`transaction` (all or nothing over several calls; :func:`before_write_in_place` lets
it undo writes into a tensor) and :func:`apply_method` (a
method object, with the new mask's dtype as an argument), ``max_layer_sparsity`` on :func:`global_unstructured` and
:class:`LayerCollapseWarning` (a parameter left with no weight).

Users need only these names. The rest of lightprune (the callback, structure, adapters, export) also imports the
engine submodules below, its internal API: not for users, free to change between versions, and the only engine
submodules other packages of lightprune may import (``tests/prune/test_internal_api.py`` checks it):

* ``allocation``: per-layer sparsity allocation (ERK, OWL) and OWL's defaults;
* ``amount``: amount validation and conversion (torch's underscore helpers);
* ``collapse``: layer collapse: the cap on a layer's pruned units, its check and the warning's message;
* ``distributed``: DTensor shards: telling a sharded tensor, its local piece, exact selection across ranks;
* ``distributed_obs``: OBS / SparseGPT on weights sharded by rows (each rank its own rows, selection across ranks);
* ``functional``: ``remove_masked`` (:func:`remove` zeroing in place, for in-place masking);
* ``k_smallest``: exact k-smallest selection over one or many tensors;
* ``masking``: applying a boolean mask, in place or into a new tensor;
* ``obs``: the layer-level pieces of OBS / SparseGPT (matrices, Hessian checks, saliencies, the row update);
* ``regrow``: one drop-and-grow mask update of dynamic sparse training (RigL, SET);
* ``rowwise``: per-row ranking to a target sparsity;
* ``signed``: signed-score variants of the magnitude methods (movement);
* ``stale``: pruned tensors a parent reads without calling their module's forward, kept current;
* ``state_dict``: pruned state_dicts in plain torch terms.

Example:
    >>> import torch
    >>> from lightprune import prune
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> prune.global_unstructured([(net[0], "weight"), (net[2], "weight")], prune.L1Unstructured, amount=0.5)
    >>> sorted(net[0].state_dict())
    ['bias', 'weight_mask', 'weight_orig']
    >>> sum(int((m.weight == 0).sum()) for m in (net[0], net[2]))
    40
"""

from lightprune.prune._reparam import (
    before_write_in_place,
    get_mask_dtype,
    mask_dtype,
    original,
    pruned_names,
    refresh_pruned,
    set_mask_dtype,
    transaction,
)
from lightprune.prune.amount import (
    _compute_norm,
    _compute_nparams_toprune,
    _validate_pruning_amount,
    _validate_pruning_amount_init,
    _validate_pruning_dim,
    _validate_structured_pruning,
)
from lightprune.prune.base import BasePruningMethod, PruningContainer
from lightprune.prune.collapse import LayerCollapseWarning
from lightprune.prune.functional import (
    apply_method,
    custom_from_mask,
    global_unstructured,
    identity,
    is_pruned,
    l1_unstructured,
    ln_structured,
    prepare_for_state_dict,
    random_structured,
    random_unstructured,
    remove,
    rowwise_l1_unstructured,
    semi_structured,
)
from lightprune.prune.methods import (
    CustomFromMask,
    Identity,
    L1Unstructured,
    LnStructured,
    RandomStructured,
    RandomUnstructured,
)
from lightprune.prune.obs import (
    input_second_moment,
    obs_saliency,
    obs_semi_structured,
    obs_unstructured,
    sparsegpt,
)
from lightprune.prune.rowwise import RowwiseL1Unstructured
from lightprune.prune.semi_structured import SemiStructured

__all__ = [
    "BasePruningMethod",
    "CustomFromMask",
    "Identity",
    "L1Unstructured",
    "LayerCollapseWarning",
    "LnStructured",
    "PruningContainer",
    "RandomStructured",
    "RandomUnstructured",
    "RowwiseL1Unstructured",
    "SemiStructured",
    "_compute_norm",
    "_compute_nparams_toprune",
    "_validate_pruning_amount",
    "_validate_pruning_amount_init",
    "_validate_pruning_dim",
    "_validate_structured_pruning",
    "apply_method",
    "before_write_in_place",
    "custom_from_mask",
    "get_mask_dtype",
    "global_unstructured",
    "identity",
    "input_second_moment",
    "is_pruned",
    "l1_unstructured",
    "ln_structured",
    "mask_dtype",
    "obs_saliency",
    "obs_semi_structured",
    "obs_unstructured",
    "original",
    "prepare_for_state_dict",
    "pruned_names",
    "random_structured",
    "random_unstructured",
    "refresh_pruned",
    "remove",
    "rowwise_l1_unstructured",
    "semi_structured",
    "set_mask_dtype",
    "sparsegpt",
    "transaction",
]
