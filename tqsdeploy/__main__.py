from tqsdeploy.cli import main

main()
