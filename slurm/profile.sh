# Sourced by the batch scripts: PROFILE (the experiment profile, default $1) checked before any GPU work.
#   choose_profile DEFAULT SCRIPT "$@"   -> PROFILE set, or exit 2 with one line
choose_profile() {
  local default=$1 script=$2 a
  shift 2
  PROFILE=${PROFILE:-$default}
  for a in "$@"; do case "$a" in +experiment=*|experiment=*)
    echo "error: the profile is a variable here: PROFILE=${a#*=} sbatch $script (not $a)" >&2; exit 2;; esac; done
  if [ ! -f "configs/experiment/$PROFILE.yaml" ]; then  # sbatch runs from the submission directory: the checkout
    echo "error: PROFILE=$PROFILE: no configs/experiment/$PROFILE.yaml; profiles:" \
      $(cd configs/experiment 2>/dev/null && ls *.yaml | sed 's/\.yaml$//') >&2; exit 2
  fi
}
