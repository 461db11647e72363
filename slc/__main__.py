from slc.cli import main

main()
