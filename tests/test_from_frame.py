"""autopar.io.layouts.from_frame: string columns to codes in every form pandas
holds them (Arrow strings, sliced or chunked, Python strings, categoricals),
a column of one repeated value by its bytes (no lookup per row) included."""
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from autopar.io.errors import SpecError
from autopar.io.layouts import CHOICES, FIELDS, _string_codes, from_frame

RECOMPUTE = CHOICES["activation_recompute"]      # full, attn_only, none, mlp_only


def _expected(values, choices):
    return np.array([choices.index(v) if v in choices else -1 for v in values])


@pytest.mark.parametrize("values", [
    ["none"] * 50,                                    # one value
    ["full", "none"] * 25,                            # same length, two values
    ["none"] * 49 + ["full"],                         # differs only in the last row
    ["full"] + ["none"] * 49,                         # differs only in the first row
    ["attn_only"] * 20 + ["mlp_only"] * 30,           # lengths 9 and 8
    ["full"] * 13 + ["none"] * 37,                    # chunked: one value per chunk
    ["none"] * 10 + ["nonex"] + ["none"] * 9,         # an unknown value among known ones
    ["nonx"] * 50,                                    # one unknown value
])
@pytest.mark.parametrize("form", ["str", "object", "category", "sliced", "chunked"])
def test_codes_equal_the_lookup(values, form):
    if form == "str":
        s = pd.Series(values, dtype="str")
    elif form == "object":
        s = pd.Series(values, dtype=object)
    elif form == "category":
        s = pd.Series(values, dtype="category")
    elif form == "sliced":            # an Arrow array with a nonzero offset
        s = pd.Series(values[:1] * 7 + values, dtype="str").iloc[7:]
        assert pa.array(s.array, from_pandas=True).offset == 7
    else:                             # several Arrow chunks
        s = pd.Series(pd.arrays.ArrowExtensionArray(
            pa.chunked_array([values[:13], [], values[13:]], type=pa.string())))
    codes = _string_codes(s, RECOMPUTE)
    assert codes.shape == (len(values),)
    np.testing.assert_array_equal(codes, _expected(values, RECOMPUTE))


def test_one_value_is_a_view_of_its_code():
    codes = _string_codes(pd.Series(["rs_ag"] * 1000, dtype="str"),
                          CHOICES["tensor_par_comm_type"])
    assert codes.strides == (0,) and not codes.flags.writeable
    assert codes[0] == CHOICES["tensor_par_comm_type"].index("rs_ag")


def test_nulls_and_empty_strings_are_unknown():
    with_null = pd.Series(["none", None, "none"], dtype="str")
    np.testing.assert_array_equal(_string_codes(with_null, RECOMPUTE), [2, -1, 2])
    np.testing.assert_array_equal(_string_codes(pd.Series([""] * 4, dtype="str"), RECOMPUTE),
                                  [-1] * 4)
    assert _string_codes(pd.Series([], dtype="str"), RECOMPUTE).shape == (0,)


def _frame(n, **change):
    row = dict(num_procs=8, tensor_par=2, pipeline_par=2, data_par=2, tensor_par_net=0,
               pipeline_par_net=0, data_par_net=0, batch_size=8, microbatch_size=1,
               datatype="bfloat16", fused_activation=True, attention_type="multihead",
               activation_recompute="full", pipeline_interleaving=1,
               optimizer_sharding=False, tensor_par_comm_type="rs_ag",
               tensor_par_overlap="none", seq_par_ag_redo=False, data_par_overlap=False,
               weight_offload=False, activations_offload=False, optimizer_offload=False,
               training=True, optimizer="adam")
    frame = pd.DataFrame([row] * n)
    for f, v in change.items():
        frame[f] = v
    return frame


def test_from_frame_constant_and_mixed_columns():
    frame = _frame(6, activation_recompute=["full", "none"] * 3)
    cols = from_frame(frame)
    assert set(FIELDS) <= set(cols)
    np.testing.assert_array_equal(cols["activation_recompute"], [0, 2] * 3)
    np.testing.assert_array_equal(cols["optimizer"], [0] * 6)
    assert cols["datatype"].dtype == np.int8 and cols["activation_recompute"].dtype == np.int8
    np.testing.assert_array_equal(cols["datatype"], [CHOICES["datatype"].index("bfloat16")] * 6)


@pytest.mark.parametrize("column, values, message", [
    ("optimizer", ["adamw"] * 5, "unknown value 'adamw'"),         # one value, unknown
    ("optimizer", ["adam"] * 4 + ["lion"], "unknown value 'lion'"),
    ("datatype", [9] * 5, "code out of range"),
])
def test_from_frame_unknown_values_name_the_column(column, values, message):
    with pytest.raises(SpecError) as err:
        from_frame(_frame(5, **{column: values}))
    assert err.value.field == column and message in str(err.value)
