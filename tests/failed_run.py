"""What a failed run said, for a test's assertion message."""

import re

# A line that names an error. A rank's C++ abort (gloo's "terminate called ... what(): ...") can
# come pages before the other ranks' tracebacks, so a tail of the output alone may miss it.
ERROR = re.compile(r"terminate called|what\(\)|Fatal Python error|Error\b|error:")


def why(p):
    """Every distinct error line of the whole stderr, first as they came, then the tails of stdout
    and stderr."""
    errors = list(dict.fromkeys(line for line in p.stderr.splitlines() if ERROR.search(line)))
    return "\n".join(
        [
            p.stdout[-2000:],
            "--- the error lines of every rank, first as they came:",
            *errors[:20],
            "--- the tail of stderr:",
            p.stderr[-3000:],
        ]
    )
