#!/usr/bin/env bash
# What `make test` needs from Debian beside Python: a browser for the page and in-browser checks
# (chromium) and TeX for the PDF (xelatex, latexmk, about 140 MB to download and 415 MB installed).
# When some are missing, install them if this user may (root, or sudo without a password); otherwise
# print the one command to run and fail before any test starts.
#   scripts/system_packages.sh           install what is missing (or say how)
#   scripts/system_packages.sh --check   only list what is missing; exit 1 if anything is
set -euo pipefail

TEX_PACKAGES="texlive-latex-recommended texlive-latex-extra texlive-fonts-recommended texlive-xetex latexmk texlive-plain-generic fonts-freefont-otf"

browser=()
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || browser=(chromium)
tex=()
if ! command -v xelatex >/dev/null 2>&1 || ! command -v latexmk >/dev/null 2>&1 || ! command -v kpsewhich >/dev/null 2>&1; then
  tex=($TEX_PACKAGES)
fi
missing=("${browser[@]}" "${tex[@]}")
[ ${#missing[@]} -eq 0 ] && exit 0

# The browser with its recommended packages (fonts), TeX without (they would add about a gigabyte).
commands=()
[ ${#browser[@]} -eq 0 ] || commands+=("apt-get install -y ${browser[*]}")
[ ${#tex[@]} -eq 0 ] || commands+=("apt-get install -y --no-install-recommends ${tex[*]}")
if [ "${1:-}" = "--check" ]; then
  echo "missing Debian packages: ${missing[*]}"
  exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  echo "make test needs Debian packages that are not installed and that this user may not install:" >&2
  line="sudo apt-get update"
  for c in "${commands[@]}"; do line="$line && sudo $c"; done
  echo "    $line" >&2
  echo "Run that once, then make test again." >&2
  exit 1
fi
echo "make test: installing from Debian: ${missing[*]} (TeX is about 140 MB to download)"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
[ ${#browser[@]} -eq 0 ] || "${as_root[@]}" apt-get install -y -qq "${browser[@]}" >/dev/null
[ ${#tex[@]} -eq 0 ] || "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${tex[@]}" >/dev/null
