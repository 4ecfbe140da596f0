"""The block store: arena, index, tiers and the policies that decide what lives where."""
