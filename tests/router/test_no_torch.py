import subprocess
import sys

import pytest


@pytest.mark.slow
def test_router_and_its_tokenizer_do_not_import_torch():
    code = (
        "import asyncio, sys\n"
        "import pdserve.router.app, pdserve.launch.local, pdserve.router.cli\n"
        "from pdserve.router.tokenizer import LocalTokenizer\n"
        "tokenizer = LocalTokenizer.load(None)\n"
        "body = {'messages': [{'role': 'user', 'content': 'Hi'}]}\n"
        "ids = asyncio.run(tokenizer.token_ids('/v1/chat/completions', body))\n"
        "assert len(ids) > 5, ids\n"
        "sys.exit(3 if 'torch' in sys.modules else 0)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 0
