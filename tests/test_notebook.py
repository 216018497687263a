"""examples/notebook.ipynb, executed cell by cell in a real Jupyter kernel (nbclient + ipykernel).

In a kernel there is no script to re-execute, so launch forks. Checked: the workers' prints
reach the cell, a failing worker raises in the cell with its rank and traceback, and the
kernel survives it: the training cell runs again and gives the same numbers.
"""

from __future__ import annotations

import re

import pytest

from conftest import REPO

nbformat = pytest.importorskip("nbformat", reason="needs the test extra: pip install scopedlite[test]")
nbclient = pytest.importorskip("nbclient", reason="needs the test extra: pip install scopedlite[test]")
pytest.importorskip("ipykernel", reason="needs the test extra: pip install scopedlite[test]")

FAILING_CELL = """
with lite.launch(strategy="ddp", devices=2, accelerator="cpu") as run:
    if run.global_rank == 1:
        raise ValueError("rank 1 found a bad batch")
    lite.barrier()
"""

CHILDREN_CELL = """
import psutil
print("children", [p.pid for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE])
"""


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")


def _losses(text: str) -> list[float]:
    return [float(v) for v in re.findall(r"epoch \d: loss ([0-9.]+)", text)]


@pytest.mark.timeout(150)
def test_notebook_trains_reports_a_failing_rank_and_runs_again(tmp_path):
    nb = nbformat.read(REPO / "examples" / "notebook.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=90, resources={"metadata": {"path": str(tmp_path)}}
    )
    code = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"]
    train_index = next(i for i in code if "lite.launch" in nb.cells[i].source)
    with client.setup_kernel():
        for index in code:
            client.execute_cell(nb.cells[index], index)
        first = _stdout(nb.cells[train_index])
        assert "[rank 1] rank 1 of 2: 8 batches per epoch" in first, first  # a forked worker's print
        assert "rank 0 of 2: 8 batches per epoch" in first
        losses = _losses(first)
        assert len(losses) == 3 and losses[-1] < losses[0], first  # lite.print: rank 0, once each
        assert first.count("trained; back to one process") == 1

        failing = nbformat.v4.new_code_cell(FAILING_CELL)
        nb.cells.append(failing)
        with pytest.raises(nbclient.exceptions.CellExecutionError) as info:
            client.execute_cell(failing, len(nb.cells) - 1)
        error = next(o for o in failing.outputs if o.output_type == "error")
        assert error.ename == "WorkerFailedError"
        assert "rank 1 raised ValueError: rank 1 found a bad batch" in error.evalue
        assert "--- traceback of rank 1 ---" in error.evalue and 'raise ValueError("rank 1 found' in error.evalue
        assert "WorkerFailedError" in str(info.value)

        again = nb.cells[train_index]
        client.execute_cell(again, train_index)  # the kernel survived: run the training again
        assert _losses(_stdout(again)) == losses

        check = nbformat.v4.new_code_cell(CHILDREN_CELL)
        nb.cells.append(check)
        client.execute_cell(check, len(nb.cells) - 1)
        assert _stdout(check).strip() == "children []"  # no worker left behind in the kernel
