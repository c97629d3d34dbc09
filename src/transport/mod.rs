mod verbs;
