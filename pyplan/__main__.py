from pyplan.cli.main import entry

entry()
