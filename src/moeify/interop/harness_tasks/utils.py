"""The helpers the task configs of this directory name with ``!function utils.NAME``
(lm-eval looks for utils.py beside the YAML files)."""

from moeify.interop.harness_data import (blimp_strict, lambada_context,  # noqa: F401
                                         lambada_target, local_json)
