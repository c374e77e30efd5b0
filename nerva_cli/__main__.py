from nerva_cli.cli import main

main()
