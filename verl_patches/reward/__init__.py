"""Rule rewards for the recipe's data sets (ALGORITHMS.md section 7).

Plain functions with verl's custom-reward signature; nothing here patches verl.
"""
