from nerva_cli.cli.app import main

main()
