"""verl_patches"""
