"""Arguments taken for torch's sake but refused, and unit-scaling's docstring helpers (its
``unit_scaling.docs`` path): `docstring_from`, `inherit_docstring`, `format_docstring`."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ipu_unit_scaling.docs import (
    binary_constraint_docstring,
    docstring_from,
    format_docstring,
    inherit_docstring,
    mult_docstring,
    unsupported,
)


def test_docstring_from_takes_torchs_docstring_edited_and_refuses_unsupported_values():
    @docstring_from(F.dropout, short_description="Unit-scaled dropout.",
                    add_args=[mult_docstring()], unsupported_args=["inplace"])
    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,
                inplace: bool = False) -> torch.Tensor:
        return input

    doc = dropout.__doc__ or ""
    assert doc.startswith("Unit-scaled dropout.\n")
    assert "inplace: **[not supported by ipu-unit-scaling]**" in doc
    assert "    mult (float, optional):" in doc and doc.index("mult (") > doc.index("inplace:")
    assert torch.equal(dropout(torch.ones(2), inplace=False), torch.ones(2))
    with pytest.raises(ValueError, match="'inplace' argument has not been implemented"):
        dropout(torch.ones(2), 0.5, True, True)


def test_docstring_from_refuses_a_name_that_is_no_argument():
    with pytest.raises(ValueError, match="has no such argument"):
        docstring_from(F.gelu, unsupported_args=["nonexistent"])(lambda input: input)


def test_inherit_docstring_takes_the_parents_and_checks_init():
    @inherit_docstring(short_description="A linear layer.", unsupported_args=["device"])
    class Linear(torch.nn.Linear):
        pass

    assert (Linear.__doc__ or "").startswith("A linear layer.\n")
    assert Linear(2, 3).out_features == 3
    with pytest.raises(ValueError, match="'device' argument"):
        Linear(2, 3, device="meta")


def test_format_docstring_and_the_shared_argument_lines():
    @format_docstring(binary_constraint_docstring)
    def op() -> None:
        """An op.

        Args:
            {0}
        """

    assert "constraint (Optional[str], optional)" in (op.__doc__ or "")
    assert "'to_grad_input_scale'" in binary_constraint_docstring
    assert mult_docstring("alpha").startswith("alpha (float, optional)")


def test_unsupported_marks_a_function():
    @unsupported("sparse")
    def embedding(input: torch.Tensor, sparse: bool = False) -> torch.Tensor:
        return input

    with pytest.raises(ValueError, match="'sparse'"):
        embedding(torch.ones(1), sparse=True)
