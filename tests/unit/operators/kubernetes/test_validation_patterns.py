"""CRD patterns are Go RE2; the offline validator compiles them with Python's `re`, which refuses inline
flags after the anchor (`^(?i)...`, Kueue's AdmissionCheck parameters.kind). They are moved in front."""

from __future__ import annotations

import re

import pytest

from operators.kubernetes.validation import SchemaValidationError, python_pattern, validate_object

KIND_PATTERN = "^(?i)[a-z]([-a-z0-9]*[a-z0-9])?$"  # kueue.x-k8s.io_admissionchecks.yaml, v1beta2


def test_leading_inline_flags_move_before_the_anchor():
    assert python_pattern(KIND_PATTERN) == "(?i)^[a-z]([-a-z0-9]*[a-z0-9])?$"
    assert python_pattern("^[a-z]+$") == "^[a-z]+$"
    compiled = re.compile(python_pattern(KIND_PATTERN))
    assert compiled.search("MultiKueueConfig") and not compiled.search("Multi_Kueue")


def admission_check(kind: str) -> dict:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "AdmissionCheck", "metadata": {"name": "mk"},
            "spec": {"controllerName": "kueue.x-k8s.io/multikueue",
                     "parameters": {"apiGroup": "kueue.x-k8s.io", "kind": kind, "name": "mk"}}}


def test_the_admission_check_crd_validates_with_its_case_insensitive_pattern(crd_registry):
    validate_object(admission_check("MultiKueueConfig"), crd_registry)
    with pytest.raises(SchemaValidationError, match="does not match"):
        validate_object(admission_check("Multi_Kueue"), crd_registry)
