from deltarun.cli.main import cli

cli()
