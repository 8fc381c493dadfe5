# Jobs arrive with the "Jobs" issue: training runs on reserved cards.
