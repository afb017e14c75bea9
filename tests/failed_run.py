"""What a failed run said, for a test's assertion message."""

import re

# A line that names an error. A rank's C++ abort (gloo's "terminate called ... what():
# ...") can come pages before the other ranks' tracebacks: the output's tail may miss it.
ERROR = re.compile(r"terminate called|what\(\)|Fatal Python error|Error\b|error:")


def why(p):
    """Every distinct error line of the whole stderr, in order, then the tails of stdout and
    stderr."""
    lines = [line for line in p.stderr.splitlines() if ERROR.search(line)]
    # dict.fromkeys drops repeats and keeps the order.
    errors = list(dict.fromkeys(lines))
    return "\n".join(
        [
            p.stdout[-2000:],
            "--- the error lines of every rank, first as they came:",
            *errors[:20],
            "--- the tail of stderr:",
            p.stderr[-3000:],
        ]
    )
