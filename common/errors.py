"""One clear line for a user's mistake, instead of a traceback."""
import sys


class UserError(Exception):
    """A problem the user can fix: bad paths, bad arguments, bad data. Printed as one line."""


def exit_on_user_error(main):
    """Run main(); turn a UserError into `error: ...` on stderr and exit status 2."""
    try:
        return main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
