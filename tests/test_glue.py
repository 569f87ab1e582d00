"""attnbook.glue writes the record MyST-NB reads, so prose can quote a measured
number."""

from unittest import mock

import nbformat
from myst_nb.ext.glue import extract_glue_data_cell

from attnbook.glue import glue


def test_glue_output_is_read_back_by_myst_nb():
    shown = []
    with mock.patch(
        "IPython.display.display",
        lambda obj, raw, metadata: shown.append((obj, metadata)),
    ):
        glue("speedup", 6.4)
    ((data, metadata),) = shown
    cell = nbformat.v4.new_code_cell(
        outputs=[
            nbformat.v4.new_output(
                "display_data", data=data, metadata=metadata
            )
        ]
    )
    ((key, output),) = extract_glue_data_cell(cell)
    assert key == "speedup"
    assert output["data"]["text/plain"] == "6.4"
    # recorded, not shown in the notebook's visible output
    assert cell.outputs == []


def test_a_numpy_scalar_is_glued_as_its_number():
    import numpy as np

    shown = []
    with mock.patch(
        "IPython.display.display",
        lambda obj, raw, metadata: shown.append((obj, metadata)),
    ):
        glue("share", np.float64(0.25))
    ((data, metadata),) = shown
    cell = nbformat.v4.new_code_cell(
        outputs=[
            nbformat.v4.new_output(
                "display_data", data=data, metadata=metadata
            )
        ]
    )
    ((_, output),) = extract_glue_data_cell(cell)
    # not "np.float64(0.25)", which {glue:text}`x:.2f` cannot read
    assert output["data"]["text/plain"] == "0.25"
