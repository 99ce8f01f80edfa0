from normswap.cli import main

main()
