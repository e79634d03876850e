from deltarun.model_files.train.run import main

main()
