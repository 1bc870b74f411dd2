import subprocess
import sys


def test_core_does_not_import_torch():
    code = (
        "import sys; import pdserve.core.scheduler, pdserve.core.block_manager; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
