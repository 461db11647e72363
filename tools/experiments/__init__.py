"""The paper experiments and their run cache (`slc experiment ...`)."""
