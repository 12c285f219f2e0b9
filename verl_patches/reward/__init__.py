"""Rule rewards for the recipe's data sets (docs/DESIGN.md section 7).

Plain functions with verl's custom-reward signature; nothing here patches verl.
"""
