"""What is running when a tensor is saved: the torch function (``OpTracker``), the module (``SiteTracker``),
and which tensor it is (``TensorTable``, ``is_parameter``).

The lowest floor the runtime and the policies share: both read an ``OpCall``, neither
is imported from here.
"""

from daf.tracing.log_probabilities import (READERS, head_log_probabilities, is_log_probabilities, nodes_behind,
                                           stored_as_probabilities)
from daf.tracing.ops import ATTENTION_FUNCTIONS, RELU_FUNCTIONS, OpCall, OpTracker, tensors_in
from daf.tracing.products import (ActivationOutput, AttentionOutput, MaskedProduct, activation_output_of,
                                  attention_map_of, attention_output_of, masked_product_of, nodes_made_by,
                                  normalized_output_of, rms_normalized_output_of)
from daf.tracing.regions import REGION_RULES, region_of
from daf.tracing.sites import SiteTracker
from daf.tracing.tensors import (TensorTable, cast_of_parameter, frozen_parameter_of_cast, is_parameter, made_in_call,
                                 parameter_of_cast, parameter_storages, shares_storage, storage_addresses, tensor_key)

__all__ = ["region_of", "REGION_RULES", "OpCall", "OpTracker", "SiteTracker", "TensorTable", "tensor_key", "is_parameter", "parameter_storages", "storage_addresses", "shares_storage", "cast_of_parameter",
           "parameter_of_cast", "frozen_parameter_of_cast", "made_in_call",
           "RELU_FUNCTIONS", "ATTENTION_FUNCTIONS", "MaskedProduct", "masked_product_of", "ActivationOutput",
           "activation_output_of", "normalized_output_of", "rms_normalized_output_of", "AttentionOutput",
           "attention_output_of", "attention_map_of", "nodes_made_by", "tensors_in", "READERS", "is_log_probabilities",
           "stored_as_probabilities", "nodes_behind", "head_log_probabilities"]
