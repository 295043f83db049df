"""Every exercise test starts and ends with a clean `wb.teach` state: no remembered results, solutions off."""
import pytest

from workbench import teach


@pytest.fixture(autouse=True)
def _clean_teach_state():
    teach.reset()
    teach.use_solutions(False)
    yield
    teach.reset()
    teach.use_solutions(False)
