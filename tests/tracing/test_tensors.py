"""Which tensor is a parameter (``daf.tracing.tensors``) when parameters are wrapper subclasses (FSDP2's
DTensors) or gathered after the forward began. The two-process FSDP2 run is tests/integrations."""

import torch
from torch.testing._internal.two_tensor import TwoTensor  # a wrapper subclass, as DTensor is, without a process group

from daf.tracing import is_parameter, parameter_storages, shares_storage, storage_addresses


def test_a_wrapper_subclass_is_found_through_the_tensors_it_holds():
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    wrapped = torch.nn.Parameter(TwoTensor(a, b))
    assert storage_addresses(wrapped) == {a.data_ptr(), b.data_ptr()}  # its own storage raises when read
    model = torch.nn.Linear(4, 8)
    model.weight = wrapped
    assert {a.data_ptr(), b.data_ptr()} <= parameter_storages(model)
    assert is_parameter(a[1:], parameter_storages(model))  # a view of what the wrapper holds


def test_views_of_a_leaf_that_requires_grad_are_parameters_copies_are_not():
    gathered = torch.randn(16, 8, requires_grad=True)  # FSDP2's unsharded weight: no storage known at begin
    assert is_parameter(gathered.t()) and is_parameter(gathered.t().t()) and is_parameter(gathered[2:])
    assert not is_parameter(gathered.t().clone())  # its own storage: autograd keeps only this copy
    assert not is_parameter(gathered * 2)
    assert shares_storage(gathered.t(), gathered) and not shares_storage(gathered.clone(), gathered)


def test_an_emptied_storage_matches_nothing():
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.bias.untyped_storage().resize_(0)  # FSDP2 frees an unsharded weight this way between uses
    assert 0 in storage_addresses(model.bias) and 0 not in parameter_storages(model)
    empty = torch.empty(0)  # no memory either: it must not pass for a view of the freed bias
    assert storage_addresses(empty) == {0}
    assert not is_parameter(empty, parameter_storages(model)) and not shares_storage(empty, model.bias)
